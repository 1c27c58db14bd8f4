"""What both sides of a tap share: consumers by id, a record's bytes and fields, and the arrays
handed over in Python."""
