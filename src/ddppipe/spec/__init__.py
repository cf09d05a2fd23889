"""The configuration: its schema, validation, presets and the scaling grid."""
