"""The aiohttp front end: OpenAI-compatible routes, SSE streaming, health and metrics.

Its packages, lowest first; a package imports only its own modules and those of packages
below it (tests/test_layout.py holds the ladder):

  errors.py     APIError and the error body: the vocabulary every package speaks
  telemetry/    Prometheus metrics, OpenTelemetry traces
  tools/        tool calling and structured output: requests in, tool calls read out
  openai/       OpenAI's wire formats: request bodies parsed, response shapes built
  admission/    tiers at the door: limits, buckets, the queued work, refusals
  models/       the chat models served: a model, the fleet, escalation, canaries
  server/       the plumbing every handler shares: state, wire, auth, CORS, request log, safety
  generation/   the pipeline every generating route runs, and stored turns
  routes/       the handlers, one module per API
  openapi/      the OpenAPI document, read from the routes
  app.py        the app factory: middlewares and every route mounted
  serve.py      `chatd serve`: the engine, the store and the app started and stopped

telemetry/ and tools/ share a layer, as do openai/, admission/ and models/: packages in one
layer do not import each other.
"""
