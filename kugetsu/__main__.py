from kugetsu.frontends.cli.main import run

run()
