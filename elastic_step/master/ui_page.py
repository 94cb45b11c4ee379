PAGE = "<!doctype html><title>placeholder</title>"
