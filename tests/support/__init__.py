"""Helpers the tests share (not tests): tiny GGUF files, the hostile-adapter corpus, a server started and driven
the way the HTTP tests need. The model and adapter builders every test uses live in tests/conftest.py."""
