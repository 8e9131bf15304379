"""hybridrl-http: the HTTP parts the first-party plugins share, apart from the core (which runs no
server and calls no service itself).

- :mod:`hybridrl_http.client`: a JSON client with timeouts, retries and bounded answers, no
  redirects followed (the vLLM and SGLang server engines, the remote reward).
- :mod:`hybridrl_http.server`: what every server checks before a body is read (Host and Origin,
  the token, sizes, slow clients) and how it listens (``hybridrl serve``, ``serve-reward``, the
  dashboard's checks).

It registers no component: plugins depend on it as on any library.
"""
