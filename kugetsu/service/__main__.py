"""`python -m kugetsu.service serve`: the service as `kugetsu serve --detach` and every autostart
start it (app/control.start_service), without the CLI's parser and the modules only the CLI's
commands use (~35 ms of each start). `serve` is there for `ps`; the foreground `kugetsu
serve` is the CLI's command, which runs the same `daemon.serve`."""

import sys

from kugetsu.errors import KugetsuError
from kugetsu.paths import default_home


def main() -> int:
    home = default_home()
    try:
        from kugetsu.app import control
        from kugetsu.service.daemon import serve

        control.check_wakeable(home)
        return serve(home)
    except KeyboardInterrupt:
        return 130
    except (KugetsuError, OSError) as err:
        from kugetsu.frontends.cli.main import failure  # said as the CLI says it (its log's last lines)

        line, code = failure(home, err)
        print(line, file=sys.stderr, flush=True)
        return code


sys.exit(main())
