"""The runtime that ``bonsai export`` copies, as text, to the top of every exported ``checkpointed.py``.

It imports nothing from ``bonsai_core``: an exported folder runs with plain PyTorch.
"""
