//go:build race

package app_test

// raceDetector is true in a -race build. watermill-amqp v2.1.3 reassigns
// ConnectionWrapper.connected on reconnect without synchronisation
// (connection.go handleConnectionClose vs IsConnected), so a closed
// RabbitMQ connection is a reported data race in that library; under -race
// the AMQP outage is simulated at the relay's publisher instead.
const raceDetector = true
