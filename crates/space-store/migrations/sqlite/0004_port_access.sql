-- Who may open each port of a sandbox on its preview host name (issue 38):
-- a JSON object `{"public": [ports], "all_public": bool}`, changed after
-- create like the network and lifecycle columns, apart from the body the
-- sandbox's actor owns. NULL: every port private.
ALTER TABLE sandboxes ADD COLUMN port_access TEXT;
