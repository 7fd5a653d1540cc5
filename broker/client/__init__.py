"""The client SDK (broker.client.sdk) and the embedded mode's factory (broker.client.embedded)."""
