from streamlit.testing.v1 import AppTest


def test_app_opens_on_the_default_model():
    at = AppTest.from_file("../explorer/app.py", default_timeout=60).run()
    assert not at.exception
    assert at.metric[0].value == "267"
