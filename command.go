// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"

	caddycmd "github.com/caddyserver/caddy/v2/cmd"
	"github.com/spf13/cobra"
)

// The `caddy rate-limit` command: the admin API's zones, keys and keys'
// own limits, for operators, as tables or as the API's JSON.

func init() {
	caddycmd.RegisterCommand(caddycmd.Command{
		Name:  "rate-limit",
		Usage: "zones|top|get|reset|limit|unlimit ... [--address <interface>] [--json]",
		Short: "Inspects rate limit zones and keys, and sets a key's own limit",
		Long: `
Talks to the running Caddy's admin API (its /rate_limit/ routes):

  caddy rate-limit zones
  caddy rate-limit top     <zone> [-n 20]
  caddy rate-limit get     <zone> <key>
  caddy rate-limit reset   <zone> <key>
  caddy rate-limit limit   <zone> <key> [--rate 100r/s] [--burst 200] [--for 24h]
  caddy rate-limit unlimit <zone> <key>

limit gives a key its own rate and burst in place of the zone's (either may
be left out: the zone's is kept), for a while with --for; unlimit gives it
the zone's back. The admin address is --address, else the one of --config,
or of a Caddyfile in the current directory, else the default, as for
'caddy reload'. Output is a table, or with --json
the admin API's JSON. A failed request prints the API's message and exits 1,
as does an unknown subcommand.
`,
		CobraFunc: func(cmd *cobra.Command) {
			cmd.PersistentFlags().String("address", "", "The address of the admin API, if not the default or the config's")
			cmd.PersistentFlags().StringP("config", "c", "", "Configuration file to read the admin address from, if --address is not used (default: ./Caddyfile, if there is one)")
			cmd.PersistentFlags().StringP("adapter", "a", "", "Name of the config adapter (with --config)")
			cmd.PersistentFlags().Bool("json", false, "Print the admin API's JSON")
			cmd.AddCommand(rateLimitCommands()...)
			// Alone, the command prints its help; with a word that is no
			// subcommand, it fails, so that a script's typo is no success
			// (cobra would print the help and exit 0).
			cmd.Args, cmd.SuggestionsMinimumDistance = unknownSubcommand, 2
			cmd.RunE = func(c *cobra.Command, _ []string) error { return c.Help() }
		},
	})
}

// rateLimitCommands are the subcommands of caddy rate-limit.
func rateLimitCommands() []*cobra.Command {
	top := &cobra.Command{Use: "top <zone>", Short: "The keys a zone denies most", Args: names(1),
		RunE: func(c *cobra.Command, args []string) error {
			n, _ := c.Flags().GetInt("n")
			return adminCall(c, http.MethodGet, zonePath(args[0])+"/top", nil, func(w io.Writer, v any) { printTop(w, v, n) })
		}}
	top.Flags().IntP("n", "n", 20, "How many keys to print")
	limit := &cobra.Command{Use: "limit <zone> <key>", Short: "Give a key its own limit", Args: names(2),
		RunE: func(c *cobra.Command, args []string) error {
			body, err := limitFlags(c)
			if err != nil {
				return err
			}
			return adminCall(c, http.MethodPut, keyPath(args[0], args[1])+"/limit", body, printFields)
		}}
	limit.Flags().String("rate", "", "The key's rate, such as 100r/s (default: the zone's)")
	limit.Flags().Int64("burst", 0, "The key's burst (default: the zone's)")
	limit.Flags().String("for", "", "How long the limit lasts, such as 24h (default: until unlimit)")
	return []*cobra.Command{
		{Use: "zones", Short: "The zones of the running config", Args: cobra.NoArgs,
			RunE: func(c *cobra.Command, _ []string) error {
				return adminCall(c, http.MethodGet, "/rate_limit/", nil, printZones)
			}},
		top,
		{Use: "get <zone> <key>", Short: "A key's bucket now, and its own limit", Args: names(2),
			RunE: func(c *cobra.Command, args []string) error {
				return adminCall(c, http.MethodGet, keyPath(args[0], args[1]), nil, printFields)
			}},
		{Use: "reset <zone> <key>", Short: "Make a key's bucket full again", Args: names(2),
			RunE: func(c *cobra.Command, args []string) error {
				return adminCall(c, http.MethodDelete, keyPath(args[0], args[1]), nil, printFields)
			}},
		limit,
		{Use: "unlimit <zone> <key>", Short: "Give a key the zone's limit back", Args: names(2),
			RunE: func(c *cobra.Command, args []string) error {
				return adminCall(c, http.MethodDelete, keyPath(args[0], args[1])+"/limit", nil, printFields)
			}},
	}
}

// unknownSubcommand refuses the arguments of caddy rate-limit itself: the
// first is a subcommand it does not have, told with the ones it may have
// meant.
func unknownSubcommand(c *cobra.Command, args []string) error {
	if len(args) == 0 {
		return nil
	}
	msg := fmt.Sprintf("unknown command %q for %q", args[0], c.CommandPath())
	if s := c.SuggestionsFor(args[0]); len(s) > 0 {
		msg += ": did you mean " + strings.Join(s, " or ") + "?"
	}
	return errors.New(msg)
}

// names checks that a subcommand has its n arguments, a zone and maybe
// a key, none of them empty: the admin API's path cannot carry an empty
// one (Caddy's admin endpoint cleans the // it leaves into the path of
// another zone or key, and redirects there).
func names(n int) cobra.PositionalArgs {
	return func(c *cobra.Command, args []string) error {
		if err := cobra.ExactArgs(n)(c, args); err != nil {
			return err
		}
		for i, a := range args {
			if a == "" {
				return fmt.Errorf("the %s must not be empty", [...]string{"zone", "key"}[i])
			}
		}
		return nil
	}
}

// limitFlags is the body of a PUT of a key's own limit, from the flags.
func limitFlags(c *cobra.Command) ([]byte, error) {
	body := map[string]any{}
	if rate, _ := c.Flags().GetString("rate"); rate != "" {
		body["rate"] = rate
	}
	if c.Flags().Changed("burst") {
		burst, _ := c.Flags().GetInt64("burst")
		body["burst"] = burst
	}
	if d, _ := c.Flags().GetString("for"); d != "" {
		body["expires_in"] = d
	}
	if len(body) == 0 {
		return nil, errors.New("give --rate, --burst or both")
	}
	return json.Marshal(body)
}

// zonePath and keyPath are the admin API's paths of a zone and a key:
// names escaped (segment), and a key named top or limits with its first
// letter escaped, so that it is read as a key.
func zonePath(zone string) string { return "/rate_limit/" + segment(zone) }

func keyPath(zone, key string) string {
	k := segment(key)
	if key == "top" || key == "limits" {
		k = fmt.Sprintf("%%%02X", key[0]) + key[1:]
	}
	return zonePath(zone) + "/" + k
}

// segment is a name as one segment of a path. url.PathEscape leaves "."
// and ".." as they are, and a path reads those as this folder and the
// one up: Caddy's admin endpoint would clean them away and answer for
// another path (get <zone> .. printed every zone). Their dots escaped,
// they are names like any other.
func segment(name string) string {
	if name == "." || name == ".." {
		return strings.Repeat("%2E", len(name))
	}
	return url.PathEscape(name)
}

// adminCall sends a request to the admin API and prints its answer: as
// JSON with --json, else with print. An error carries the API's message.
func adminCall(c *cobra.Command, method, path string, body []byte, print func(io.Writer, any)) error {
	c.SilenceUsage = true
	flags := c.Flags()
	address, _ := flags.GetString("address")
	config, _ := flags.GetString("config")
	adapter, _ := flags.GetString("adapter")
	addr, err := adminAddress(address, config, adapter)
	if err != nil {
		return err
	}
	var r io.Reader
	if body != nil {
		r = bytes.NewReader(body)
	}
	resp, err := caddycmd.AdminAPIRequest(addr, method, path, nil, r)
	if err != nil {
		return adminError(err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if asJSON, _ := flags.GetBool("json"); asJSON {
		_, err = c.OutOrStdout().Write(raw)
		return err
	}
	var v any
	if err := json.Unmarshal(raw, &v); err != nil {
		return fmt.Errorf("reading the admin API's answer: %v", err)
	}
	print(c.OutOrStdout(), v)
	return nil
}

// adminAddress is the admin API's address as caddy reload finds it:
// address, else the admin address of the config file (configFile, else
// a Caddyfile in the current directory), else the default.
func adminAddress(address, configFile, adapter string) (string, error) {
	if address != "" {
		return address, nil
	}
	config, configFile, _, err := caddycmd.LoadConfig(configFile, adapter)
	if err != nil {
		return "", err
	}
	return caddycmd.DetermineAdminAPIAddress("", config, configFile, adapter)
}

// adminError is the admin API's message of a failed request, when it
// said one.
func adminError(err error) error {
	msg := err.Error()
	i := strings.Index(msg, "HTTP ")
	j := strings.IndexByte(msg, '{')
	var e struct {
		Error string `json:"error"`
	}
	if i < 0 || j < i || json.Unmarshal([]byte(msg[j:]), &e) != nil || e.Error == "" {
		return err
	}
	return fmt.Errorf("%s%s", msg[i:j], e.Error)
}

// printZones prints the zones as a table.
func printZones(w io.Writer, v any) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ZONE\tLIMIT\tSTORE\tALLOWED\tDENIED")
	for _, z := range list(v, "zones") {
		req, _ := z["requests"].(map[string]any)
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", text(z["name"]), text(z["limit"]), text(z["store"]), text(req["allowed"]), text(req["denied"]))
	}
	tw.Flush()
}

// printTop prints at most n of the keys a zone denies most.
func printTop(w io.Writer, v any, n int) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ZONE\tKEY\tDENIALS")
	for _, z := range each(v) {
		for i, k := range list(z, "top") {
			if i == n {
				break
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\n", text(z["zone"]), text(k["key"]), text(k["denials"]))
		}
	}
	tw.Flush()
}

// printFields prints an answer's fields, one a line, a zone after the
// other; an override's and a share's too; and last, with reserves, each
// class's tokens, from the highest class: what it may take now of the
// most it may.
func printFields(w io.Writer, v any) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	for i, z := range each(v) {
		if i > 0 {
			fmt.Fprintln(tw)
		}
		var classes []string
		if cs, ok := z["classes"].([]any); ok {
			delete(z, "classes")
			for _, c := range cs {
				c, _ := c.(map[string]any)
				classes = append(classes, fmt.Sprintf("classes.%s\t%s of %s\n", text(c["class"]), text(c["remaining"]), text(c["capacity"])))
			}
		}
		for _, part := range []string{"override", "share"} {
			if o, ok := z[part].(map[string]any); ok {
				delete(z, part)
				for k, x := range o {
					z[part+"."+k] = x
				}
			}
		}
		keys := make([]string, 0, len(z))
		for k := range z {
			keys = append(keys, k)
		}
		sort.Slice(keys, func(a, b int) bool {
			return fieldRank(keys[a]) < fieldRank(keys[b]) || fieldRank(keys[a]) == fieldRank(keys[b]) && keys[a] < keys[b]
		})
		for _, k := range keys {
			fmt.Fprintf(tw, "%s\t%s\n", k, text(z[k]))
		}
		for _, c := range classes {
			fmt.Fprint(tw, c)
		}
	}
	tw.Flush()
}

// fieldRank puts the fields that say what an answer is of first.
func fieldRank(k string) int {
	if i, ok := firstFields[k]; ok {
		return i
	}
	return len(firstFields)
}

var firstFields = map[string]int{"zone": 0, "limit": 1, "key": 2, "bucket": 3}

// each is the answer of one zone, or each zone's of {"zones": [...]}.
func each(v any) []map[string]any {
	m, _ := v.(map[string]any)
	if _, ok := m["zones"].([]any); ok {
		return list(m, "zones")
	}
	return []map[string]any{m}
}

// list is the objects of the array field of v.
func list(v any, field string) []map[string]any {
	m, _ := v.(map[string]any)
	arr, _ := m[field].([]any)
	out := make([]map[string]any, 0, len(arr))
	for _, x := range arr {
		if o, ok := x.(map[string]any); ok {
			out = append(out, o)
		}
	}
	return out
}

// text is a JSON value as a table cell.
func text(x any) string {
	switch x := x.(type) {
	case nil:
		return "-"
	case string:
		return x
	case float64:
		return strconv.FormatFloat(x, 'f', -1, 64)
	case bool:
		return strconv.FormatBool(x)
	}
	b, _ := json.Marshal(x)
	return string(b)
}
