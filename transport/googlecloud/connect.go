package googlecloud

import (
	"os"
	"strings"
)

// fieldSettings names the fields of Config, for Open called directly.
func fieldSettings(field string) string {
	return "googlecloud.Config." + strings.TrimPrefix(field, "GoogleCloud.")
}

// emulatorSetting names where the emulator's address came from:
// EmulatorHost's source, or PUBSUB_EMULATOR_HOST, which the client
// library reads when EmulatorHost is empty.
func emulatorSetting(cfg Config, setting func(string) string) string {
	if cfg.EmulatorHost == "" && os.Getenv("PUBSUB_EMULATOR_HOST") != "" {
		return "PUBSUB_EMULATOR_HOST"
	}
	return setting("GoogleCloud.EmulatorHost")
}

// credentialsSetting names where the credentials came from: the
// CredentialsFile's source, or the application default credentials.
func credentialsSetting(cfg Config, setting func(string) string) string {
	if cfg.CredentialsFile != "" {
		return "the credentials file (from " + setting("GoogleCloud.CredentialsFile") + ")"
	}
	return "the application default credentials (GOOGLE_APPLICATION_CREDENTIALS)"
}
