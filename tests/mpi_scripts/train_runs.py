"""Under mpiexec: several ``psgrad train`` runs in one job, one after another (scenarios.py: the
start-up is paid once).

Arguments: each run's ``psgrad train`` options, the runs separated by ``--``. Every run is parsed
by that command's own parser and config steps (``--config`` included) and trained with
``train.run`` on every rank; the job stops at the first run that fails."""

import sys

from scenarios import split_runs

from psgrad.cli import train
from psgrad.options import config_from, with_config
from psgrad.train import run

for args in split_runs(sys.argv[1:]):
    options = train.make_context("psgrad train", args).params
    run(config_from(with_config(options, options.pop("config_path", None))))
