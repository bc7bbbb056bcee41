"""The command line: megatron's parser with the entry's options (``arguments``, with the fast
path's in ``fast_path_options``), ``--config FILE.yaml`` (``config_file``), and a misspelled
option or a bad value as one line (``option_errors``). What a command line gives beyond its
values (the options it names, ``--spec local``) is ``megagpt.flags``, which the layers read too."""
