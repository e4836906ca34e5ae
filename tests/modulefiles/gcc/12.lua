-- Test stand-in for a site's compiler module: the system g++ 12 is already on PATH.
whatis("GCC 12 (test stand-in)")
setenv("TEST_MODULE_GCC", "12")
