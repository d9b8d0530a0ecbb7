package failure_test

import (
	"encoding/json"
	"errors"
	"fmt"

	"github.com/millwright/millwright/failure"
)

// A handler marks what no retry can fix; whoever decides reads the mark
// through any wrapping.
func ExamplePermanent() {
	decode := func(payload []byte) error {
		var order struct{ ID string }
		if err := json.Unmarshal(payload, &order); err != nil {
			return failure.Permanent(fmt.Errorf("decoding order: %w", err))
		}
		return nil
	}

	err := fmt.Errorf("handler: %w", decode([]byte("{not json")))
	fmt.Println(err)
	fmt.Println("permanent:", failure.IsPermanent(err))
	fmt.Println("permanent:", failure.IsPermanent(errors.New("connection refused")))
	fmt.Println("nil stays nil:", failure.Permanent(nil) == nil)
	// Output:
	// handler: decoding order: invalid character 'n' looking for beginning of object key string
	// permanent: true
	// permanent: false
	// nil stays nil: true
}
