"""The OpenAI API without a transport: request bodies, validation, errors and response building.

The HTTP server (`frontends/http`) and the batch pipe (`frontends/batch`) both import this and
neither imports the other.
"""
