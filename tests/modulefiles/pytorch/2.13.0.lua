-- Test stand-in for a site's PyTorch module: the Python of the tests' venv (VENV) first on PATH.
whatis("PyTorch 2.13.0 (test stand-in)")
local venv = os.getenv("VENV")
if venv == nil or venv == "" then
    LmodError("pytorch/2.13.0 (test stand-in): set VENV to the tests' venv")
end
prepend_path("PATH", pathJoin(venv, "bin"))
setenv("TEST_MODULE_PYTORCH", "2.13.0")
