"""The OpenAI-compatible HTTP gateway: `streambatch-gateway` (pip install 'streambatch[gateway]').

app.py holds the endpoints, shapes.py the request bodies and what they become, render.py our
events as OpenAI's objects, auth.py API keys to tenants, __main__.py the command line.
"""
