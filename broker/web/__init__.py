"""The web dashboard's files (``assets/``): one HTML page, its script and style, served
by broker.api.dashboard. Plain HTML, CSS and a JavaScript module, with no build step
and no third-party code, so the package carries them as they are to an air-gapped site.
"""
