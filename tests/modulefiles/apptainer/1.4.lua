-- Test stand-in for a site's Apptainer module: puts the tests' apptainer stand-in on PATH.
whatis("Apptainer 1.4 (test stand-in)")
local tests = myFileName():match("(.*)/modulefiles/")
prepend_path("PATH", pathJoin(tests, "standins"))
