-- Test stand-in for a site's CUDA toolkit module (the test machines have no GPU).
whatis("CUDA 12.8 (test stand-in)")
setenv("CUDA_HOME", "/usr/local/cuda-12.8")
