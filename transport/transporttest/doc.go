// Package transporttest gives tests a transport.Config for each kind,
// reaching a real broker whenever one is there:
//
//   - Kafka: the brokers in MILLWRIGHT_TEST_KAFKA_BROKERS; unset, the broker
//     scripts/services.sh starts on 127.0.0.1:9092 if it answers; otherwise
//     an in-process kfake cluster shared by the process's tests.
//   - Pub/Sub: the emulator in MILLWRIGHT_TEST_PUBSUB_EMULATOR_HOST; unset,
//     Google's emulator on 127.0.0.1:8085 if it answers; otherwise an
//     in-process pstest server.
//   - RabbitMQ: MILLWRIGHT_TEST_AMQP_URL (default amqp://guest:guest@127.0.0.1:5672/).
//   - Postgres: MILLWRIGHT_TEST_DATABASE_URL (default the local test
//     database); the sql kind gets a fresh schema per call.
//
// Falling back to a fake is never silent: every test that does logs why,
// and with MILLWRIGHT_TEST_REAL_BROKERS=1 (or a list of kinds; .ci/run sets
// it) the test fails instead. MILLWRIGHT_TEST_KAFKA_BROKERS=fake or
// MILLWRIGHT_TEST_PUBSUB_EMULATOR_HOST=fake chooses the fake on purpose.
// Every test process prints, once, which brokers are real (Brokers).
//
//	for _, kind := range transport.Kinds {
//		t.Run(string(kind), func(t *testing.T) {
//			tr := transporttest.Open(t, kind) // closed at cleanup
//			...
//		})
//	}
//
// Tests that inject faults a real broker cannot (kfake's request control,
// pstest's reactors) ask for the fake by name: FakeKafka, FakePubSub.
package transporttest
