"""Memory a server holds after load, over a session of requests (issue 48): llama-server's prompt cache and
context checkpoints (fitter.session.server, sizes from fitter.session.state)."""
