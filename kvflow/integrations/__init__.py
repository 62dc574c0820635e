"""kvflow inside inference servers. Each integration imports its server only when imported
itself: ``import kvflow`` never does."""
