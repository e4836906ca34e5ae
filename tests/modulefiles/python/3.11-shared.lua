-- Test stand-in for an EasyBuild-style Python module: a shared-library build (--enable-shared)
-- without RPATH, whose python finds libpython only through LD_LIBRARY_PATH. The test that
-- loads it builds such a python in SHARED_PYTHON (bin/, lib/): test_pbs_launcher.py.
whatis("Python 3.11, shared library without RPATH (test stand-in)")
local home = os.getenv("SHARED_PYTHON")
if home == nil or home == "" then
    LmodError("python/3.11-shared (test stand-in): set SHARED_PYTHON to the python the test built")
end
prepend_path("PATH", pathJoin(home, "bin"))
prepend_path("LD_LIBRARY_PATH", pathJoin(home, "lib"))
setenv("TEST_MODULE_PYTHON", "3.11")
