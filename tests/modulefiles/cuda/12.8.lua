-- Test stand-in for a site's CUDA toolkit module (the test machines have no GPU): a toolkit
-- folder whose bin/nvcc only answers --version.
whatis("CUDA 12.8 (test stand-in)")
local tests = myFileName():match("(.*)/modulefiles/")
local home = pathJoin(tests, "standins", "cuda-12.8")
setenv("CUDA_HOME", home)
prepend_path("PATH", pathJoin(home, "bin"))
