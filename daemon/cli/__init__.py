"""The `facecast` command: one module per verb, `main` parses and delegates. Runs on the CLI
side, in the user's process; the supervisor's rooms (facecast.daemon) never import it."""
