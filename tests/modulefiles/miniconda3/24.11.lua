-- Test stand-in for a site's Miniconda module: puts the tests' conda stand-in on PATH.
whatis("Miniconda 3 (test stand-in)")
local tests = myFileName():match("(.*)/modulefiles/")
prepend_path("PATH", pathJoin(tests, "standins"))
