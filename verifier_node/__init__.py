"""pipespec: verifier_node."""
