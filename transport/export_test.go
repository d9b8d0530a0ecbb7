package transport

// FromLookup is fromLookup, for the external tests.
var FromLookup = fromLookup
