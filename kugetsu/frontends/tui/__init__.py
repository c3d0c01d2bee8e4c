"""The Textual dashboard (`kugetsu dashboard`). Importing this package imports textual, so
only the dashboard command does it."""
