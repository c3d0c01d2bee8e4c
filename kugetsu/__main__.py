from kugetsu.cli import run

run()
