package saga

// Migration moves instances of one definition version to another; built
// by Migrate.
type Migration struct {
	from, to Versioned
	place    func(old []byte, at Position) ([]byte, Position, error)
}

// Position is where an instance stands in its version.
type Position struct {
	// Step is the name of the step whose command's reply the instance
	// waits for.
	Step string
}
