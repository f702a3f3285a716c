"""The fifth mode: ``meshkit extproc``, an Envoy external-processing endpoint
picker (``docs/extproc.md``). Needs the ``meshkit[extproc]`` extra (grpcio,
xds-protos); importing :mod:`meshkit` never loads it."""
