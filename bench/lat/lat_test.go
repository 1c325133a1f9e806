package lat

import (
	"context"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
)

var ours = redis.NewScript(func() string { b, _ := os.ReadFile("../../lua/token_bucket.lua"); return string(b) }())
var rr = redis.NewScript(func() string { b, _ := os.ReadFile("/tmp/exp/rr.lua"); return string(b) }())

func client(opt string) redis.UniversalClient {
	o := &redis.UniversalOptions{Addrs: []string{"127.0.0.1:6390"}, PoolSize: 1}
	if opt == "ours" {
		o.ContextTimeoutEnabled = true
		o.MaxRetries = -1
		o.DialTimeout, o.ReadTimeout, o.WriteTimeout, o.PoolTimeout = time.Second, time.Second, time.Second, time.Second
		o.MaintNotificationsConfig = &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}
	}
	return redis.NewUniversalClient(o)
}

func BenchmarkLat(b *testing.B) {
	for _, opt := range []string{"plain"} {
		for _, sc := range []string{"ours", "rr"} {
			for _, dl := range []bool{false} {
				name := opt + "/" + sc
				if dl {
					name += "/deadline"
				}
				b.Run(name, func(b *testing.B) {
					c := client(opt)
					defer c.Close()
					for i := 0; i < b.N; i++ {
						ctx := context.Background()
						var cancel context.CancelFunc
						if dl {
							ctx, cancel = context.WithDeadline(ctx, time.Now().Add(time.Second))
						}
						var err error
						if sc == "ours" {
							err = ours.Run(ctx, c, []string{"rl:{" + strconv.Itoa(i%10000) + "}hot:k" + strconv.Itoa(i%10000)}, "take", "", "1000000", "1", "0", "0", 0, "0").Err()
						} else {
							err = rr.Run(ctx, c, []string{"rate:k" + strconv.Itoa(i%10000)}, 1000000, 1000000, 1, 1).Err()
						}
						if cancel != nil {
							cancel()
						}
						if err != nil {
							b.Fatal(err)
						}
					}
				})
			}
		}
	}
}
