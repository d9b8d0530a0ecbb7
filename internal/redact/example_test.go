package redact_test

import (
	"fmt"

	"github.com/millwright/millwright/internal/redact"
)

func ExampleText() {
	fmt.Println(redact.Text(`connecting to postgres://app:hunter2@db:5432/orders: refused`))
	fmt.Println(redact.Text(`parse "postgres://app:hunter2@db:badport/orders": invalid port`))
	fmt.Println(redact.Text(`host=db user=app password=hunter2 dbname=orders`))
	// Output:
	// connecting to postgres://app:xxxxx@db:5432/orders: refused
	// parse "postgres://app:xxxxx@db:badport/orders": invalid port
	// host=db user=app password=xxxxx dbname=orders
}
