"""The container: building images, their identity, running commands inside them."""
