"""The command line: megatron's parser with the entry's options (``arguments``, with the fast
path's in ``fast_path_options``), ``--config FILE.yaml`` (``config_file``), a misspelled option
or a bad value as one line (``option_errors``), and what the command line gives beyond its
values (``flags``)."""
