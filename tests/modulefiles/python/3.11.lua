-- Test stand-in for a site's Python module: the tests' interpreter is already on PATH.
whatis("Python 3.11 (test stand-in)")
setenv("TEST_MODULE_PYTHON", "3.11")
