"""The server's OpenAPI 3.1 document (`GET /openapi.json`): openapi.py assembles it from the
handlers' own limits and fields, with request bodies (openapi_bodies.py) and named response
schemas (openapi_components.py).

Imports of chatd/http: everything but the top level (app.py, serve.py): it reads the routes.
"""
