"""The Ray layer: actors, placement, the driver loop, the Serve app and the ``dspark`` CLI."""
