"""The configuration: its schema, validation and presets, the typed run spec, the run's layout
and kind, and the scaling grid."""
