"""The APIs the frontend serves, one module (or package of `protocol` and `serving`) per API, each with a
`routes(serving)` that the server mounts."""
