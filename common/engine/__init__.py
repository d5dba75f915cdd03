"""The round engine and reply handling: one round of any method, its replies screened, stored and put on the wire."""
