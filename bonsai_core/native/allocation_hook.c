/* Preloaded into a measured process (bonsai_core/allocations.py): counts the bytes of the blocks
   posix_memalign hands out (c10's CPU allocator) until they are freed, and the most at once. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <stdint.h>
#include <pthread.h>

#define CAP (1u << 22)
static uintptr_t keys[CAP];
static size_t sizes[CAP];
static size_t live, peak, tracked, untracked;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int (*real_posix_memalign)(void **, size_t, size_t);
static void (*real_free)(void *);

static inline uint32_t slot(uintptr_t p) { return (uint32_t)((p >> 6) * 2654435761u) & (CAP - 1); }

__attribute__((constructor)) static void init(void) {
  real_posix_memalign = dlsym(RTLD_NEXT, "posix_memalign");
  real_free = dlsym(RTLD_NEXT, "free");
}

int posix_memalign(void **out, size_t alignment, size_t size) {
  if (!real_posix_memalign) init();
  int err = real_posix_memalign(out, alignment, size);
  if (err == 0 && *out) {
    pthread_mutex_lock(&lock);
    if (tracked < CAP / 2) { /* a half-full table keeps probes short; past it, say so (untracked) */
      uint32_t i = slot((uintptr_t)*out);
      while (keys[i]) i = (i + 1) & (CAP - 1);
      keys[i] = (uintptr_t)*out; sizes[i] = size; tracked++;
      live += size; if (live > peak) peak = live;
    } else {
      untracked++;
    }
    pthread_mutex_unlock(&lock);
  }
  return err;
}

void free(void *p) {
  if (!real_free) init();
  if (p) {
    pthread_mutex_lock(&lock);
    uint32_t i = slot((uintptr_t)p);
    while (keys[i] && keys[i] != (uintptr_t)p) i = (i + 1) & (CAP - 1);
    if (keys[i]) {
      live -= sizes[i]; tracked--;
      /* backward-shift deletion keeps probe chains intact */
      uint32_t j = i;
      for (;;) {
        j = (j + 1) & (CAP - 1);
        if (!keys[j]) break;
        uint32_t k = slot(keys[j]);
        if ((j > i && (k <= i || k > j)) || (j < i && (k <= i && k > j))) {
          keys[i] = keys[j]; sizes[i] = sizes[j]; i = j;
        }
      }
      keys[i] = 0;
    }
    pthread_mutex_unlock(&lock);
  }
  real_free(p);
}

size_t allocation_hook_live(void) { return live; }
size_t allocation_hook_untracked(void) { return untracked; }
size_t allocation_hook_peak(void) { return peak; }
void allocation_hook_reset_peak(void) { pthread_mutex_lock(&lock); peak = live; pthread_mutex_unlock(&lock); }
