//go:build !race

package app_test

// raceDetector is true in a -race build (see race_on_test.go).
const raceDetector = false
