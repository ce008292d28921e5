"""Background work: the one periodic-task wrapper every loop of the broker runs under."""
