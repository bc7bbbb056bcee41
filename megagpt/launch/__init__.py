"""One launch, decided once: what a command line comes to on this machine."""
