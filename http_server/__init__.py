"""An OpenAI-compatible HTTP front end for pipespec: FastAPI + uvicorn in the launcher's process, talking to the
verifier through one :class:`runtime.client.AsyncClient`.

``app.create_app`` builds the app (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
``/metrics``); ``serve.HttpServer`` runs it on a socket inside an event loop the caller owns (the launcher's).
"""
