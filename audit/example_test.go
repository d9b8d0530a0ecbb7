package audit_test

import (
	"fmt"

	"github.com/millwright/millwright/audit"
)

func ExampleRedactArgs() {
	fmt.Println(audit.RedactArgs([]string{
		"--database-url=postgres://app:hunter2@db:5432/orders",
		"--transport=kafka://b1:9092?sasl_user=svc&sasl_password=hunter2",
		"--topic=orders",
	}))
	// Output:
	// [--database-url=postgres://app:xxxxx@db:5432/orders --transport=kafka://b1:9092?sasl_password=xxxxx&sasl_user=svc --topic=orders]
}
