"""What several test files share: builders and fakes. Imported by tests, never by conftest."""
