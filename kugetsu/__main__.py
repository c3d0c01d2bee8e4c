from kugetsu.frontends.cli.thin import run

run()
