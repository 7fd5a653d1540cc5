"""The REST API: one router per resource, assembled by broker.api.app, served by
broker.api.server.
"""
