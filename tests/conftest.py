# Its folder on sys.path (pytest's prepend import mode puts a conftest's folder there), so
# tests/gpu/ imports the shared test helpers of tests/ (e.g. api_cases) as tests/ does.
